"""Process groups and collectives for one replica's world (TP inside a stage, PP across)."""
