"""Everything inside one replica's torch.distributed world (see docs/structure.md)."""
