"""The `data` section every stage shares: where rows come from, how they are blended, and the one split
that gives SFT, the reward model and RL disjoint parts (DeepSpeed-Chat's `data_split 2,4,4`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from toolkit.config.base import ExistingFile, ExistingPath, Section, Seed

STAGES = ("sft", "rm", "rl")


class DataSource(Section):
    path: ExistingPath
    """A JSON Lines file (`.jsonl`; or `.json`, which may also hold one array of objects; either may be gzipped,
    `.jsonl.gz`), a Parquet file (`.parquet`), or a directory written by Hugging Face `datasets`'
    `save_to_disk`."""
    format: Literal["auto", "jsonl", "parquet", "datasets"] = "auto"
    """`auto`: from the file name (.jsonl/.json, .parquet) or the directory (datasets)."""
    weight: float = Field(default=1.0, gt=0)
    """Blending: the share of the training rows drawn from this source is weight / sum of weights (a
    source is drawn again from its start when it runs out)."""
    name: str | None = None
    """Name in logs and errors (default: the file name)."""
    part: Literal["sft", "rm", "rl"] | None = None
    """The part of data.split that every row of this source goes to, whatever the hash gives (a file that
    only one stage reads, such as RL's own prompts); none: each row's prompt decides. A pipeline sets it
    for a stage's own sources that no other stage reads. No effect without data.split."""


class SplitSection(Section):
    """Relative sizes of the parts each stage trains on; every row goes to one part, decided by a
    seeded hash of the row, so the same row lands in the same part in every stage's config."""

    sft: float = Field(default=0.0, ge=0)
    """Relative size of the SFT part."""
    rm: float = Field(default=0.0, ge=0)
    """Relative size of the reward-model part."""
    rl: float = Field(default=0.0, ge=0)
    """Relative size of the RL part."""
    seed: Seed = 1234
    """Seed of the hash that splits the rows (and holds out the eval rows)."""

    @model_validator(mode="after")
    def _some(self) -> "SplitSection":
        if self.sft + self.rm + self.rl <= 0:
            raise ValueError("give at least one part a size above 0, e.g. split: {sft: 2, rm: 4, rl: 4}")
        return self

    def fractions(self) -> dict[str, float]:
        total = self.sft + self.rm + self.rl
        return {stage: getattr(self, stage) / total for stage in STAGES}


class DataSection(Section):
    prompts: ExistingFile | None = None
    """Shorthand for one source: `prompts: file.jsonl` is `sources: [{path: file.jsonl}]` (a file not named
    .parquet, .json or .jsonl[.gz] is read as JSON Lines)."""
    sources: list[DataSource] = []
    """Where the rows come from; several sources are blended by weight."""
    split: SplitSection | None = None
    """Split the rows between the stages (each stage uses its part); none: every stage uses every row."""
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)
    """Share of a stage's part held out for evaluation (by the same seeded hash): sft and rm evaluate on
    these rows; RL leaves them out of its prompts, and `slurm-rlhf eval RUN_DIR` scores its checkpoints on
    them."""
    shuffle: bool = True
    """Shuffle the rows (seeded by run.seed) on every pass."""
    prompt_key: str = "prompt"
    """Field with the prompt: text, or chat messages [{role, content}, ...]."""
    input_key: str | None = None
    """Alpaca-style rows `{instruction, input, output}`: the field whose text, where a row has it and it is
    not empty, follows a text prompt after a blank line (`prompt_key: instruction, input_key: input,
    response_key: output`). None: prompts are the prompt field alone."""
    response_key: str = "response"
    """SFT: field with the response (text, or the assistant's message). Rows with `chosen_key` and no
    response train on the chosen one; rows with only `messages_key` train on the last assistant message."""
    chosen_key: str = "chosen"
    """Reward model: field with the preferred response. A row without a prompt whose chosen and rejected are
    whole texts (HH-RLHF's) takes the text the two share as the prompt: up to its last "\\n\\nAssistant:",
    or, in text without that marker, up to its last whitespace."""
    rejected_key: str = "rejected"
    """Reward model: field with the other response."""
    messages_key: str = "messages"
    """Field with a whole conversation [{role, content}, ...] (prompt: every message before the last
    assistant message; response: that message)."""
    text_key: str = "text"
    """Plain-text rows (the PTX mixture of RL)."""
    chat_template: bool = False
    """Render text prompts as a user message with the tokenizer's chat template (message lists always are)."""

    @model_validator(mode="after")
    def _sources(self) -> "DataSection":
        if self.prompts is not None:
            if self.sources:
                raise ValueError("give prompts or sources, not both")
            self.sources = [DataSource.model_construct(path=self.prompts, format=shorthand_format(self.prompts),
                                                       weight=1.0, name=None, part=None)]
            self.prompts = None
        if not self.sources:
            raise ValueError("no rows: give sources: [{path: ...}] (or prompts: FILE.jsonl)")
        if self.chosen_key == self.rejected_key:
            raise ValueError(f"chosen_key and rejected_key are the same field ({self.chosen_key!r}): every pair would "
                             "be one response twice; name the two fields")
        if self.input_key is not None and self.input_key == self.prompt_key:
            raise ValueError(f"input_key is the prompt's own field ({self.input_key!r}); name the field that "
                             "holds the input (Alpaca: input_key: input, prompt_key: instruction)")
        return self


def shorthand_format(path) -> str:
    """The format of `prompts: FILE`: from its name, and JSON Lines where the name says nothing."""
    from toolkit.data.sources import format_of
    from toolkit.errors import ConfigError

    try:
        return format_of(str(path))
    except ConfigError:
        return "jsonl"
