"""weightstore.Error: what every failure of the client raises."""


class Error(Exception):
    """A failed call: `code` is the gRPC status name ("NOT_FOUND",
    "INVALID_ARGUMENT", ...), `message` says what, naming the checkpoint,
    tensor or field."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
