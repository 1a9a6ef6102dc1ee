"""The trainer formats of hsx/storage/trainers/: a format that lacks one of its pieces is refused
in one line, naming it and the piece, where its class is defined (never at export, never by
borrowing another format's behaviour), and `hsx export --to`'s choices are the registry's. What
each format writes is judged by the trainers' own readers in tests/test_export.py."""

from pathlib import Path

import pytest

from hsx.commands import cli
from hsx.errors import HsxError
from hsx.storage import trainers
from hsx.storage.trainers import base
from hsx.storage.trainers.base import TrainerFormat
from hsx.storage.trainers.specforge import SpecForgeFormat
from hsx.storage.trainers.specforge_dflash import SpecForgeDFlash


def _pieces() -> dict:
    """Every piece of a format (what each does does not matter here)."""
    return {"name": "toy", "reads_tokens": False, **{method: lambda self, *args: None for method in base.METHODS}}


def test_a_format_with_every_piece_is_defined_and_made():
    assert isinstance(type("Toy", (TrainerFormat,), _pieces())(), TrainerFormat)


@pytest.mark.parametrize("piece", [*base.ATTRIBUTES, *base.METHODS])
def test_a_format_lacking_a_piece_is_refused_in_one_line_where_it_is_defined(piece):
    pieces = _pieces()
    del pieces[piece]
    with pytest.raises(TypeError) as refused:
        type("Toy", (TrainerFormat,), pieces)
    message = str(refused.value)
    assert "\n" not in message and piece in message
    assert ("'toy'" if piece != "name" else "Toy") in message


def test_a_family_base_gives_only_its_shared_pieces():
    """SpecForge's base (itself defined with abstract=True) has the layout, the bytes and the masks
    of both SpecForge formats, not a format's layer ids, refusal or features: a format of the
    family still defines those."""
    pieces = {
        "name": "specforge-half",
        "trainer_layer_ids": lambda self, spec: {},
        "refusal": lambda self, sample: None,
    }
    with pytest.raises(TypeError, match=r"^trainer format 'specforge-half' \(Half\) lacks features\(\)$"):
        type("Half", (SpecForgeFormat,), pieces)
    pieces["features"] = lambda self, sample: {}
    assert type("Half", (SpecForgeFormat,), pieces)().path(Path("out"), 2001) == Path(
        "out/rows_2000-4000/data_2001.ckpt"
    )


def test_a_format_does_not_take_another_formats_name():
    with pytest.raises(TypeError, match=r"^trainer format Borrowed lacks its name"):

        class Borrowed(SpecForgeDFlash):  # would write as DFlash, under DFlash's name
            def refusal(self, sample):
                return None


def test_two_formats_of_one_name_are_refused_at_registration():
    with pytest.raises(TypeError, match="both named 'specforge-dflash'"):
        trainers._registry(trainers.FORMATS["specforge-dflash"], SpecForgeDFlash())


def test_to_choices_are_the_registry_names():
    export = cli.build_parser().hsx_commands["export"]
    (to,) = [action for action in export.hsx_flags if "--to" in action.option_strings]
    assert tuple(to.choices) == trainers.names() == tuple(trainers.FORMATS)
    assert all(fmt.name == name for name, fmt in trainers.FORMATS.items())
    assert trainers.by_name("speculators") is trainers.FORMATS["speculators"]
    with pytest.raises(HsxError, match='expected one of specforge-dflash, specforge-eagle3, speculators, got "x"'):
        trainers.by_name("x")
