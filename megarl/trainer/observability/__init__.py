"""What a run shows: metrics.jsonl and the loggers, the console progress display, phase timing, memory per phase,
and the plots; plus the logging section of the config."""
