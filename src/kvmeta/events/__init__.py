"""KV events: the storage tier's stores and removals, published in the engines' own wire format
(``wire``) on a ZeroMQ PUB socket, with a replay socket for subscribers that were away
(``publisher``, ``replay``). See docs/events.md."""

__all__: list[str] = []
