"""Helpers every layer may use and that know nothing of the timeline.

    clock        the wall clock, and a manual one for tests and fast replays
    ratelimit    a drop or an error always counted, logged at most once per interval
    listener     the one HTTP listener (IPv4 or IPv6), its URL, the bearer-token check
    selfmetrics  the collector's /metrics server, and its listeners' refusals
    stats        percentiles and nearest ranks over plain lists
    linsolve     a small dense linear solve for the step-cost fits
    timeparse    durations as typed on a command line (90s, 30m, 2h)
    usage        UsageError, what a command line is refused with
    texttable    rows as an aligned text table
    oneline      any text as one line, cut at a length
    gctune       the garbage collector tuned for a long-running collector
"""
