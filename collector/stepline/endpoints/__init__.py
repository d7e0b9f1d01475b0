"""What the collector serves besides /metrics: read-only SQL over ClickHouse's HTTP protocol (`query`, with its chDB
`sessions`), and POST /v1/events for stepline's own tools (`events`)."""
