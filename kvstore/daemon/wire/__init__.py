"""The daemon protocol, shared by both ends of the socket.

- :mod:`~kvstore.daemon.wire.frames`: the fixed header, the operations, the errors.
- :mod:`~kvstore.daemon.wire.messages`: the typed messages and their payload encodings.
- :mod:`~kvstore.daemon.wire.auth`: login by challenge-response.
- :mod:`~kvstore.daemon.wire.layout_check`: a layout refused at login, and the error naming every field that differs.
"""
