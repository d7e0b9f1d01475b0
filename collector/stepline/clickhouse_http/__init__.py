"""ClickHouse's HTTP protocol, with no sockets: the query endpoint serves it, the events endpoint reads bodies with it.

    errors       the error codes, SqlRefused, the HTTP status and exception line an answer carries
    settings     the settings among a request's URL parameters (the engine's profile decides which may be set)
    guard        the read-only SQL guard, the lexer it reads with, a query's SETTINGS as ClickHouse prints them
    body         request bodies: strict HTTP/1.1 framing under a limit, multipart/form-data fields
    compression  ClickHouse's compressed blocks and the HTTP Content-Encodings, of requests and responses
    native       Native blocks as a `client_protocol_version` client reads them
    formats      output formats joined across chDB's blocks, and their Content-Type
"""
