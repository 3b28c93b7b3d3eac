"""Input files: every file of a directory is validated before the model loads (issue 10)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.runner import EXIT_BAD_INPUT, JobError, run_job
from pipeline.spec import load_spec
from tests.pipeline.helpers import invoke, no_model, rows, write_corpus


def _later_csv(directory):
    (directory / "b.parquet").write_text("id,text\nx,hello\n")
    return "b.parquet: not a Parquet file"


def _later_wrong_type(directory):
    pq.write_table(pa.table({"id": ["x"], "text": [42], "topic": ["t"]}), directory / "b.parquet")
    return "column 'text' is int64 in"


def _later_missing_column(directory):
    pq.write_table(pa.table({"id": ["x"], "body": ["hello"], "topic": ["t"]}), directory / "b.parquet")
    return "column 'text' not found in"


@pytest.mark.parametrize("make_later_file", [_later_csv, _later_wrong_type, _later_missing_column])
def test_every_input_file_is_validated(job, tmp_path, make_later_file):
    directory = tmp_path / "corpus"
    directory.mkdir()
    write_corpus(directory / "a.parquet")
    message = make_later_file(directory)
    path = job({"input": {"path": str(directory)}})
    result = invoke("run", path)
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output and "b.parquet" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(JobError) as error:
        run_job(load_spec(path), load_model=no_model)
    assert error.value.exit_status == EXIT_BAD_INPUT


def test_files_that_agree_on_string_types_are_read_together(job, tmp_path):
    directory = tmp_path / "corpus"
    directory.mkdir()
    write_corpus(directory / "a.parquet", n=2)
    table = pa.table({"id": pa.array(["z"], pa.large_string()), "text": pa.array(["more"], pa.large_string()), "topic": ["t"]})
    pq.write_table(table, directory / "b.parquet")
    result = invoke("run", job({"input": {"path": str(directory)}, "variants": [{"method": "full"}]}), "-q")
    assert result.exit_code == 0, result.output
    assert rows(tmp_path / "store.db", "select count(*) from documents where status = 'done'") == [(3,)]
