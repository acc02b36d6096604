"""Documents as users keep them: JSONL, Parquet, a Hugging Face `datasets.save_to_disk` folder.

    found = open_documents("docs.jsonl", text_field="text")   # or .parquet, or a save_to_disk folder
    tokens, cache_file, documents = tokenize(found, tokenizer)  # a memory map of the token ids

Each document's text is read in turn (JSONL line by line, Parquet a batch of rows at a time,
Arrow files through a memory map), tokenised CHUNK_CHARS characters at a time and appended to
a token file in the cache, which the run then memory-maps like a `.bin`: host memory is a
chunk's, whatever the file's size. The token file is kept, keyed by the files (path, size,
time), the field and the tokenizer, so a resumed run or the next one reads it again instead
of tokenising anew. Each document ends with the tokenizer's EOS id where it has one (an
imported model's), else with a blank line, so one document's end is visible in the next's
context, as the models were trained.

Parquet and Arrow are read with `pyarrow` (the format's own reader); `datasets` is not needed
for a folder it wrote, whose layout is Arrow IPC stream files named by its `state.json`.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from collections.abc import Iterator

import numpy as np

TEXT_FIELD = "text"  # the field (JSONL key, Parquet / Arrow column) holding each document's text
FORMATS = "JSONL, Parquet, or a datasets.save_to_disk folder"
CHUNK_CHARS = 1 << 20  # characters tokenised at once: what bounds the host memory of a read
SEPARATOR = "\n\n"  # after each document, for a tokenizer with no EOS id
ROWS = 1024  # Parquet rows per read
ARROW_STATE, ARROW_DICT = "state.json", "dataset_dict.json"  # what save_to_disk writes beside its Arrow files
CACHE_VERSION = 1  # part of the cache key: a change to how documents are joined makes new files


class DocumentError(ValueError):
    """Documents that cannot be read as asked: one line, naming the file and row."""


def is_documents(path: str) -> bool:
    """Whether `path` is one of the document formats (else text or token ids)."""
    if os.path.isdir(path):
        return any(os.path.exists(os.path.join(path, name)) for name in (ARROW_STATE, ARROW_DICT)) or \
            bool(glob.glob(os.path.join(path, "*.arrow")))
    return path.endswith((".jsonl", ".parquet"))


@dataclasses.dataclass
class Documents:
    """Where a run's documents are and which field holds their text."""

    path: str
    format: str  # jsonl, parquet or arrow
    files: list[str]
    text_field: str

    def texts(self) -> Iterator[str]:
        """Every document's text, in file order, each checked to be a string."""
        read = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[self.format]
        for name in self.files:
            yield from read(name, self.text_field)

    def chunks(self) -> Iterator[list[str]]:
        """The texts in lists of about CHUNK_CHARS characters (one document may be more)."""
        chunk, size = [], 0
        for text in self.texts():
            chunk.append(text)
            size += len(text)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk


def open_documents(path: str, text_field: str = TEXT_FIELD) -> Documents:
    """`path`'s documents, its format and files found (nothing read yet)."""
    if not os.path.isdir(path):
        return Documents(path, "jsonl" if path.endswith(".jsonl") else "parquet", [path], text_field)
    if os.path.exists(os.path.join(path, ARROW_DICT)):  # a DatasetDict: one folder per split
        with open(os.path.join(path, ARROW_DICT)) as f:
            splits = json.load(f).get("splits", [])
        raise DocumentError(f"--data {path}: a datasets DatasetDict of splits {', '.join(splits)}. Fix: --data "
                            f"{os.path.join(path, splits[0] if splits else 'SPLIT')} (one split's folder).")
    state = os.path.join(path, ARROW_STATE)
    if os.path.exists(state):  # the files in the dataset's order
        with open(state) as f:
            files = [os.path.join(path, entry["filename"]) for entry in json.load(f).get("_data_files", [])]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.arrow")))
    if not files:
        raise DocumentError(f"--data {path}: a datasets folder with no Arrow files in it. Fix: point --data at the "
                            "folder Dataset.save_to_disk wrote.")
    return Documents(path, "arrow", files, text_field)


def _jsonl(name: str, field: str) -> Iterator[str]:
    with open(name, "rb") as f:  # bytes: a line that is not UTF-8 is named, not a decode error mid-read
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{name}:{number}"
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DocumentError(f"--data {where}: not UTF-8 (byte {e.start} of the line). Fix: write the file "
                                    "as UTF-8.") from None
            except ValueError as e:
                raise DocumentError(f"--data {where}: not JSON ({e}). Fix: one JSON object per line.") from None
            if not isinstance(row, dict):
                raise DocumentError(f"--data {where}: a JSON {type(row).__name__}, not an object. Fix: one JSON "
                                    f'object per line, e.g. {{"{field}": "..."}}.')
            yield _text(row.get(field), where, field, list(row), field in row)


def _text(value, where: str, field: str, fields: list[str], present: bool) -> str:
    """`value` where it is a document's text; else one line saying what is there."""
    if isinstance(value, str):
        return value
    if not present:
        shown = ", ".join(map(repr, fields[:8])) + (" ..." if len(fields) > 8 else "") or "none"
        fix = f"--text-field {fields[0]}" if fields else f'a "{field}" in every row'
        raise DocumentError(f"--data {where}: no field {field!r} (its fields: {shown}). Fix: {fix}.")
    raise DocumentError(f"--data {where}: field {field!r} is {json.dumps(value)[:40]}, not a string. Fix: a text "
                        "in every row, or --text-field naming the field that holds it.")


def _column(schema, name: str, field: str):
    """The column holding the text: present, and of strings."""
    import pyarrow as pa

    if field not in schema.names:
        _text(None, name, field, schema.names, False)
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DocumentError(f"--data {name}: column {field!r} holds {kind}, not strings. Fix: --text-field naming "
                            f"the text column (columns: {', '.join(schema.names)}).")


def _rows(batches, name: str, field: str) -> Iterator[str]:
    """The texts of record batches of one file; a missing value is named by its row (from 1)."""
    row = 0
    for batch in batches:
        for text in batch.column(batch.schema.get_field_index(field)).to_pylist():
            row += 1
            if text is None:
                raise DocumentError(f"--data {name}: row {row} has no {field!r} (null). Fix: drop the row, or fill "
                                    "it with text.")
            yield text


def _parquet(name: str, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(name)
    except (pa.ArrowException, OSError) as e:
        raise DocumentError(f"--data {name}: not a Parquet file ({str(e).splitlines()[0]}). Fix: write it with "
                            "pyarrow / pandas .to_parquet.") from None
    _column(file.schema_arrow, name, field)
    yield from _rows(file.iter_batches(batch_size=ROWS, columns=[field]), name, field)


def _arrow(name: str, field: str) -> Iterator[str]:
    import pyarrow as pa

    with pa.memory_map(name) as source:  # the pages are the file's: nothing copied into the heap
        try:
            reader = pa.ipc.open_stream(source)  # what save_to_disk writes
            batches = iter(reader)
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                file = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise DocumentError(f"--data {name}: not an Arrow file ({e}). Fix: point --data at the folder "
                                    "Dataset.save_to_disk wrote.") from None
            reader, batches = file, (file.get_batch(i) for i in range(file.num_record_batches))
        _column(reader.schema, name, field)
        yield from _rows(batches, name, field)


def cache_dir() -> str:
    """Where tokenised documents are kept (beside `jshard train`'s measured CPU peak)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jshard", "tokens")


def _key(found: Documents, tokenizer) -> str:
    """What a token file depends on: the files as they are now, the field, the tokenizer."""
    files = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in found.files]
    what = dict(files=files, field=found.text_field, tokenizer=tokenizer.identity(), eos=tokenizer.eos_id,
                version=CACHE_VERSION)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def _encode(tokenizer, texts: list[str], dtype) -> np.ndarray:
    """`texts` as one run of ids, each document ended by EOS (or SEPARATOR)."""
    if tokenizer.eos_id is None:
        return np.concatenate(tokenizer.encode_each([t + SEPARATOR for t in texts])).astype(dtype)
    eos = np.asarray([tokenizer.eos_id])
    return np.concatenate([part for ids in tokenizer.encode_each(texts) for part in (ids, eos)]).astype(dtype)


def tokenize(found: Documents, tokenizer) -> tuple[np.memmap, str, int]:
    """`found`'s documents as token ids in a cached file: (its memory map, the file, the number
    of documents). Reads one chunk at a time; a file already made for the same input is reused."""
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    path = os.path.join(directory, f"{_key(found, tokenizer)}.{np.dtype(dtype).name}")
    count_path = path + ".json"
    if not (os.path.exists(path) and os.path.exists(count_path)):
        temporary = f"{path}.{os.getpid()}.tmp"
        count = 0
        try:
            with open(temporary, "wb") as f:
                for chunk in found.chunks():
                    _encode(tokenizer, chunk, dtype).tofile(f)
                    count += len(chunk)
        except BaseException:
            os.remove(temporary)
            raise
        if not count:
            os.remove(temporary)
            raise DocumentError(f"--data {found.path}: empty, no documents in it. Fix: point --data at a file with "
                                "documents.")
        os.replace(temporary, path)  # atomic: every process of a run may write it, none reads half of one
        with open(temporary, "w") as f:
            json.dump({"documents": count, "source": os.path.abspath(found.path)}, f)
        os.replace(temporary, count_path)
    with open(count_path) as f:
        count = json.load(f)["documents"]
    return np.memmap(path, dtype, mode="r"), path, count
