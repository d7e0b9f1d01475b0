"""Configuration: the collector's settings (`settings`), the service-level objectives (`slo`) and what each
objective counts as good (`objectives`)."""
