"""The progress watchdog: taps the rows flowing to the writers (`tap.Watchdog`) and judges each engine against a model
of its own progress and fitted step costs (`budget`); what it exports is declared in `metrics` (and the SLIs' in
`slo`)."""
