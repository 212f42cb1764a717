"""`python -m toolkit` is the `slurm-rlhf` command."""

from toolkit.cli import main

raise SystemExit(main())
