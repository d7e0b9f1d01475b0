"""Configuration: the collector's settings (`settings`) and the service-level objectives (`slo`)."""
