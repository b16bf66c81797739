"""Task names: one rule wherever a name is made (a spec's tasks, `tasks add`, --default-task), checked before any
work, so that every name an artifact holds is one a client can send in a request (at most the HTTP and gRPC limit of
characters) and a file system can hold (task files are named by it)."""

import shutil

import pytest
import yaml

from fusionserve.cli.main import main
from fusionserve.errors import FusionServeError, SpecError
from fusionserve.export.spec import load_spec
from fusionserve.serving.options import MAX_TASK_NAME_CHARS, check_task_name

BAD = ["a/b", "..", ".hidden", "-rf", "", "x" * (MAX_TASK_NAME_CHARS + 1), "tab\there", "new\nline", "a b"]
GOOD = ["rte", "sst-2", "glue.mnli", "_private", "Amazon_Food2", "x" * MAX_TASK_NAME_CHARS]


@pytest.mark.parametrize("name", GOOD)
def test_names_a_client_can_send_are_task_names(name):
    check_task_name(name)


@pytest.mark.parametrize("name", BAD, ids=repr)
def test_other_names_are_refused_naming_the_rule(name):
    with pytest.raises(FusionServeError, match=f"1 to {MAX_TASK_NAME_CHARS} characters"):
        check_task_name(name)


def test_tasks_add_refuses_a_bad_name_in_one_line_before_any_work(tmp_path, capsys):
    """`tasks add ART "a/b"` ended in FileNotFoundError (.../tasks/.a/.b.new.npz.tmp...), a traceback after the whole
    check; the name is refused first now, before the artifact is even read (here there is none)."""
    code = main(["tasks", "add", str(tmp_path / "no-artifact"), "a/b", "--head", str(tmp_path / "no-head")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("fusionserve: error: "), err
    assert "'a/b'" in err and "no-artifact" not in err, err


def test_a_tasks_command_on_a_folder_that_is_not_there_is_one_line(tmp_path, capsys):
    """It ended in FileNotFoundError from taking the lock in the missing folder's revisions/."""
    code = main(["tasks", "remove", str(tmp_path / "no-artifact"), "t"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no-artifact: no such artifact folder" in err, err


def test_a_spec_with_a_bad_task_name_is_refused(built_st, tmp_path):
    root = tmp_path / "model"
    shutil.copytree(built_st.spec.parent, root)
    spec = yaml.safe_load((root / built_st.spec.name).read_text())
    spec["tasks"]["a/b"] = spec["tasks"].pop(next(iter(spec["tasks"])))
    (root / built_st.spec.name).write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"tasks\.a/b: 'a/b' is not a task name"):
        load_spec(root / built_st.spec.name)


def test_a_default_task_that_is_no_task_name_is_refused_as_an_option(artifact):
    from fusionserve.serving.process.server import ServerConfig

    with pytest.raises(FusionServeError, match="--default-task = a/b is out of range; allowed: a task name"):
        ServerConfig(artifact, default_task="a/b")
