"""Where allennlp is importable, elmo_client.allennlp.ConfigurationError is allennlp's: an `except` written for
allennlp catches the adapter's refusal of an empty line. Prints one JSON line; run in the allennlp environment."""

# ruff: noqa: E402 (the imports after sys.path is set, allennlp's after its stubs)
import importlib
import io
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "client")]
importlib.import_module("bench.allennlp_baseline")  # stubs what allennlp imports and ELMo never uses
from allennlp.common.checks import ConfigurationError
from elmo_client.allennlp import ConfigurationError as Ours
from elmo_client.allennlp import ElmoEmbedder

try:
    # No server is needed: the empty line is refused before anything is embedded.
    ElmoEmbedder(url="http://127.0.0.1:9").embed_file(io.StringIO("A\n\nB\n"), str(Path(sys.argv[1]) / "x.hdf5"))
    caught = None
except ConfigurationError as err:
    caught = str(err)
print(json.dumps({"subclass": issubclass(Ours, ConfigurationError), "caught": caught}))
