"""Helpers every layer may use and that know nothing of the timeline: clocks, rate-limited logging, the HTTP
listener, the collector's own metrics, statistics, duration parsing, text tables."""
