"""ClickHouse's HTTP protocol, with no sockets: the read-only SQL guard, request decoding, Native blocks as clients
read them, output formats and compression. The endpoints in `stepline.endpoints` serve it."""
