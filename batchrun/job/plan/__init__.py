"""One plan per output: shards, work units, and the checks a run makes before loading weights."""
