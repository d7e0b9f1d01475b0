"""The collector wired and run (`collector.Collector`), its metrics composed (`selfmetrics`), and `stepline demo`
(`demo`)."""
