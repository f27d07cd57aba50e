"""The error hierarchy: stable codes, Python base classes, the code bridge."""

import pytest

from dgr import errors


def _all_classes():
    return [c for c in errors.all_classes() if c.__module__ == "dgr.errors"]


def test_codes_are_unique():
    classes = _all_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), sorted(codes)


@pytest.mark.parametrize("cls", _all_classes(), ids=lambda c: c.__name__)
def test_from_code_round_trips(cls):
    err = errors.from_code(cls.code, "why")
    assert type(err) is cls
    assert str(err) == "why"


def test_unknown_code_is_base_class():
    err = errors.from_code(9999, "odd")
    assert type(err) is errors.DgrError


def test_python_bases_let_callers_catch_builtin_kinds():
    assert issubclass(errors.ModelNotFound, FileNotFoundError)
    assert issubclass(errors.InvalidToken, ValueError)
    assert issubclass(errors.UnknownSlot, LookupError)
    assert issubclass(errors.CoreNotBuilt, ImportError)
    assert issubclass(errors.MissingTokenIds, errors.InvalidBoundary)
    assert issubclass(errors.FrameChecksumError, errors.FrameError)
    assert errors.ResourceExhausted("full", retry_after=2.5).retry_after == 2.5


def test_cpp_status_codes_match():
    """cpp/include/dgr/status.h and dgr/errors.py agree on every engine and frame code."""
    import re
    from pathlib import Path

    header = (Path(__file__).parents[2] / "cpp" / "include" / "dgr" / "status.h").read_text()
    cpp = {name: int(num) for name, num in re.findall(r"k(\w+)\s*=\s*(\d+)", header)}
    pairs = {
        "ModelNotFound": errors.ModelNotFound, "InvalidModel": errors.InvalidModel,
        "UnsupportedArch": errors.UnsupportedArchitecture,
        "InvalidLayerRange": errors.InvalidLayerRange, "InvalidToken": errors.InvalidToken,
        "InvalidPosition": errors.InvalidPosition, "ContextFull": errors.ContextFull,
        "UnknownSlot": errors.UnknownSlot, "InvalidBoundary": errors.InvalidBoundary,
        "MissingTokenIds": errors.MissingTokenIds, "MtpNotSupported": errors.MtpNotSupported,
        "InvalidArgument": errors.InvalidArgument, "EngineError": errors.EngineError,
        "RollbackUnsupported": errors.RollbackUnsupported,
        "DeviceNotFound": errors.DeviceNotFound, "DeviceOutOfMemory": errors.DeviceOutOfMemory,
        "DeviceLost": errors.DeviceLost,
        # wire frames (cpp/include/dgr/frame.h)
        "FrameError": errors.FrameError, "FrameTruncated": errors.FrameTruncated,
        "FrameTooLarge": errors.FrameTooLarge, "FrameChecksum": errors.FrameChecksumError,
        "FrameVersion": errors.FrameVersionError, "UnknownCodec": errors.UnknownCodec,
        "FrameNotNative": errors.FrameNotNative,
    }
    assert cpp.pop("Ok") == 0
    assert set(cpp) == set(pairs)
    for name, cls in pairs.items():
        assert cpp[name] == cls.code, name
