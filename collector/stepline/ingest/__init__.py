"""The write path: the runner that polls every source (`runner`), one batching writer per table (`writer`), the spool
batches wait in (`spool`), and the merge of a request's reports into one row (`merge`)."""
