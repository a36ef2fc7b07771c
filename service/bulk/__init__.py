"""elmo-embed: files of sentences to vectors, on this machine or a Ray cluster.

inputs       the input files: globs, spans of whole lines keeping each line's index, the sentences read
pipeline     one machine's run: read, batch, embed and write overlapped, into hdf5 (allennlp's layout) or Parquet
hdf5_writer  the hdf5 file's datasets, and the writer process that may write them (a fresh interpreter)
parquet      the Parquet part files: a row per line, the layers as fixed-size float lists
parts        a job cut into parts, its manifest, and the merge of hdf5 parts (or --shard outputs) into one file
on_ray       the parts run by Ray Data actors, an engine each, with retries and --resume
"""

from service.bulk.hdf5_writer import WriterError
from service.bulk.inputs import ALL_LINES, InputError, Shard, Span, read_sentences
from service.bulk.pipeline import ALL_LAYERS, Output, embed_file, plan_batches, read_embeddings

__all__ = [
    "ALL_LAYERS",
    "ALL_LINES",
    "InputError",
    "Output",
    "Shard",
    "Span",
    "WriterError",
    "embed_file",
    "plan_batches",
    "read_embeddings",
    "read_sentences",
]
