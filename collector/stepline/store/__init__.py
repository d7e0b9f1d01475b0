"""The store and how to reach it: `store.Store` (chDB or a ClickHouse server), its URL (`url`), the Native batches it
is sent (`batches`), how the CLI finds a running collector (`discovery`) and reads through it (`reader`)."""
