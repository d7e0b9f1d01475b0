"""The write path, one way: the runner that polls every source (`runner`), request placement (`identity`, by the
rule of `merge`: which request a report is of), one batching writer per table (`writer`) and the spool batches wait
in (`spool`); each counts what it drops where it drops it, in the path's metrics (`metrics`)."""
