"""Documents from Parquet: streamed in record batches, reading only the columns a job needs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .spec import JobSpec, SpecError, input_files

BATCH_SIZE = 64


@dataclass
class Document:
    """One input row: its id, the values of the columns the prompt uses, and a content hash."""

    document_id: str
    fields: dict
    content_hash: str
    error: Optional[str] = None


def open_dataset(spec: JobSpec) -> ds.Dataset:
    """The input as a pyarrow dataset, after checking every file's schema.

    Each file must be Parquet and hold every column the job reads, with the same
    type in every file (``string`` and ``large_string``, ``binary`` and
    ``large_binary``, and integer widths may mix). Only footers are read here.
    """
    files = input_files(spec)
    columns = spec.input.columns()
    seen: dict[str, tuple[pa.DataType, Path]] = {}
    for path in files:
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SpecError(f"input.path: {path}: not a Parquet file ({exc})") from None
        for column in columns:
            if column not in schema.names:
                raise SpecError(f"input: column '{column}' not found in {path}; columns: {', '.join(schema.names)}")
            kind = schema.field(column).type
            if column not in seen:
                seen[column] = (kind, path)
                continue
            first_kind, first_path = seen[column]
            merged = _common_type(first_kind, kind)
            if merged is None:
                raise SpecError(
                    f"input: column '{column}' is {kind} in {path} but {first_kind} in {first_path}; "
                    "every input file needs the same column types"
                )
            seen[column] = (merged, first_path)
    schema = pa.schema([(column, seen[column][0]) for column in columns])
    return ds.dataset([str(f) for f in files], format="parquet", schema=schema)


def _type_family(kind: pa.DataType) -> str:
    if pa.types.is_dictionary(kind):
        return _type_family(kind.value_type)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "binary"
    if pa.types.is_signed_integer(kind):
        return "integer"
    return str(kind)


def _common_type(first: pa.DataType, other: pa.DataType) -> Optional[pa.DataType]:
    """One type both columns can be read as, or None when they disagree."""
    if first == other:
        return first
    family = _type_family(first)
    if family != _type_family(other):
        return None
    return {"string": pa.large_string(), "binary": pa.large_binary(), "integer": pa.int64()}.get(family)


def count_documents(dataset: ds.Dataset) -> int:
    return dataset.count_rows()


def _as_text(value, column: str) -> tuple[Optional[str], Optional[str]]:
    if value is None:
        return None, f"column '{column}' is null"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, f"column '{column}' is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    text = str(value)
    if not text.strip():
        return None, f"column '{column}' is empty"
    return text, None


def iter_documents(spec: JobSpec, dataset: ds.Dataset) -> Iterator[Document]:
    """Yield documents one by one; memory stays flat whatever the corpus size."""
    columns = spec.input.columns()
    row_number = 0
    for batch in dataset.to_batches(columns=columns, batch_size=BATCH_SIZE):
        for row in batch.to_pylist():
            row_number += 1
            raw_id = row[spec.input.id_column]
            document_id = str(raw_id) if raw_id is not None else f"<row {row_number}>"
            fields, error = {}, None
            for column in columns[1:]:
                text, problem = _as_text(row[column], column)
                fields[column] = text
                error = error or problem
            if raw_id is None:
                error = error or f"column '{spec.input.id_column}' (the id) is null"
            digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
            yield Document(document_id, fields, digest, error)


def write_pydoc_topics(path: str | Path) -> int:
    """Write CPython's reference-manual topics (``pydoc_data.topics``) to Parquet; returns rows."""
    import pyarrow.parquet as pq
    from pydoc_data.topics import topics

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)
    table = pa.table({"topic": names, "text": [topics[n] for n in names]})
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return table.num_rows
