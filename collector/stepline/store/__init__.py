"""The store and how to reach it.

    url         store URLs (chdb://, http(s)://, clickhouse://), their defaults and redaction
    errors      StoreError and its kinds: unreachable, locked by another collector
    store       `Store` (chDB or a ClickHouse server) and `LazyStore` (opened on first use)
    migrations  the schema created, and older stores brought up to it, in place
    locking     whether another process holds an embedded store
    chdb        the clickhouse-connect client over an embedded chDB session
    batches     the Native batches the writers send
    reads       `Reads`, what every reader of the timeline needs from a store, and its rows read by name (`Row`)
    discovery   the announcement files a running collector leaves, and how the CLI finds it
    reader      reading the timeline from the CLI: through a running collector's endpoint, or the store itself
"""
