"""The collector wired and run (`collector.Collector`), and `stepline demo` (`demo`)."""
