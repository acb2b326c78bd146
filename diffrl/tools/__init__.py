"""User-facing tools on top of the trainer: the CLI, sample/eval/export commands, run analysis, logging and
the reward server."""
