from gpuctl import errors
from gpuctl.errors import ExitCode


def test_exit_codes_are_pinned():
    # docs/cli.md documents these numbers; changing one breaks users' scripts.
    # __members__ lists aliases too: a second name for a number would show here.
    assert {name: int(c) for name, c in ExitCode.__members__.items()} == {
        "OK": 0, "INTERNAL": 1, "USAGE": 2, "CONFIG": 3, "NOT_FOUND": 4, "CONFLICT": 5,
        "PROJECT": 6, "REMOTE": 7, "RUN_FAILED": 8, "CLOUD": 9, "NO_CAPACITY": 10, "DECLINED": 11,
        "DATA": 12, "BILLING": 13, "INTERRUPTED": 130,
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


def test_a_providers_own_exception_left_untranslated_is_its_error_never_internal():
    """The CLI's last resort (cli/__init__.py): botocore's exceptions of any shape are the cloud's."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError

    from gpuctl import provision
    from gpuctl.errors import CloudError, ExitCode

    provision.provider_class("aws")  # as a command that used AWS has loaded it
    for exc in (bx.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"), bx.ReadTimeoutError(endpoint_url="x"),
                ResponseParserError("<html>500</html>"),
                bx.ClientError({"Error": {"Code": "Throttling", "Message": "slow down"}}, "DescribeInstances")):
        err = provision.foreign_error(exc)
        assert isinstance(err, CloudError) and err.exit_code == ExitCode.CLOUD, exc
    assert provision.foreign_error(ValueError("a bug")) is None
