"""Input Parquet files: discovery, schema checks, pins, rows -> engine requests, token counts."""
