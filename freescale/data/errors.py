"""``DataError``: a data file that cannot be read, in one line naming the file.

Its own module so that what parses files without training (``freescale prepare``, the
MovieLens download) raises it without importing torch; ``readers.DataError`` is the same class.
"""


class DataError(ValueError):
    """A data file that cannot be read; the message is one line naming the file."""
