"""Python client of the ELMo embedding service. Needs only httpx and numpy.

    from elmo_client import Client
    with Client("http://127.0.0.1:8000") as elmo:
        vectors = elmo.embed([["The", "cat", "sat"]], output="layers")  # [array (num_layers, 3, dim)]

`elmo_client.allennlp.ElmoEmbedder` stands in for allennlp 0.9's ElmoEmbedder."""

from elmo_client.chunks import Limits
from elmo_client.client import AsyncClient, Client, ElmoConnectionError, ElmoError, Embedding

__all__ = ["AsyncClient", "Client", "ElmoConnectionError", "ElmoError", "Embedding", "Limits"]
__version__ = "0.1.0"
