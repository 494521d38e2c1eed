"""Small primitives used across the layers, each importing nothing of kvstore.

- :mod:`~kvstore.util.ratelog`: rate-limited logging (a repeating condition logged once per interval).
- :mod:`~kvstore.util.breaker`: a circuit breaker per store endpoint (misses in a row make every call a fast miss).
- :mod:`~kvstore.util.budget`: a byte budget (backpressure for loads in flight).
- :mod:`~kvstore.util.prometheus`: Prometheus text exposition for every ``/metrics`` kvstore serves.
- :mod:`~kvstore.util.interrupts`: SIGTERM raised like Ctrl-C, so every cleanup runs.
"""
