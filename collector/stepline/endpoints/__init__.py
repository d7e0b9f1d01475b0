"""What the collector serves besides /metrics: read-only SQL over ClickHouse's HTTP protocol (`query`, with its chDB
`sessions`, the `watch` that kills a query whose client left, and the `chunked` body a result goes out in), and
POST /v1/events for stepline's own tools (`events`)."""
