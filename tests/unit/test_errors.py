from gpuctl import errors
from gpuctl.errors import ExitCode


def test_exit_codes_are_pinned():
    # docs/cli.md documents these numbers; changing one breaks users' scripts.
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0, "INTERNAL": 1, "USAGE": 2, "CONFIG": 3, "NOT_FOUND": 4, "CONFLICT": 5,
        "PROJECT": 6, "REMOTE": 7, "RUN_FAILED": 8, "CLOUD": 9, "NO_CAPACITY": 10, "INTERRUPTED": 130,
    }


def test_every_error_class_has_a_code_and_a_hint():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, errors.GpuctlError)]
    assert len(classes) >= 8
    for cls in classes:
        assert isinstance(cls.exit_code, ExitCode)
        assert cls("x").hint, cls


def test_docs_list_every_exit_code():
    from tests.conftest import REPO

    doc = (REPO / "docs" / "cli.md").read_text()
    for code in ExitCode:
        assert f"| {int(code)} |" in doc, f"exit code {code.name} missing from docs/cli.md"
