"""ClickHouse's HTTP protocol, with no sockets: the query endpoint serves it, the events endpoint reads bodies with it.

    errors       the error codes, SqlRefused, the HTTP status and exception line an answer carries
    settings     the settings a read-only session may set, and the caps no request lifts
    guard        the read-only SQL guard and the lexer it reads with
    body         request bodies: strict HTTP/1.1 framing under a limit, multipart/form-data fields
    compression  ClickHouse's compressed blocks and the HTTP Content-Encodings, of requests and responses
    native       Native blocks as a `client_protocol_version` client reads them
    formats      output formats joined across chDB's blocks, and their Content-Type
"""
