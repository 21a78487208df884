"""The statistician: robust statistics over records that other agents produced."""
