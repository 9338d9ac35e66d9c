"""The one exception type the command line treats as the user's mistake rather than a crash."""


class ConfigError(Exception):
    """An invalid configuration that every rank detects the same way (bad option combination, -n ≠ world size).

    The command line prints it once, from rank 0, and every rank exits with status 2 through the normal MPI
    shutdown. Raise it only for conditions that every rank sees identically: a rank-local problem is an
    ordinary exception, which aborts the whole job (a rank that exits alone would leave the others waiting).
    """

    exit_code = 2
