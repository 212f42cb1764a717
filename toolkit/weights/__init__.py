"""Weight sync from trainer rank 0 to generator workers (bucketed broadcast over a rendezvous group)."""
