"""Every actor's inbox carries one union of message types, and the actors
talk only through them.

Three checks, none of which runs the engine:

- a mailbox refuses, at the sender, every message type its actor does not
  list in ``accepts`` (all the types in ``kvserve.actors.messages``);
- every ``self.<peer>.send(Message(...))`` in ``src/actors`` and
  ``src/engine.py`` sends a type the peer's inbox takes (read from the
  source, so a wiring mistake fails here and not in production);
- actors receive their peers in the constructor: no ``assert self.<peer> is
  not None`` and no peer attribute assigned after construction.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import kvserve
from kvserve.actors import messages
from kvserve.actors.base import Mailbox
from kvserve.engine import ACTORS

SRC = Path(kvserve.__file__).parent
#: The attribute names under which the actors and the engine hold a peer's mailbox.
PEER_ATTRIBUTES = {"tokenizer_actor": "tokenizer", "admission": "admission",
                   "scheduler": "scheduler", "worker": "worker",
                   "detokenizer": "detokenizer", "stats": "stats"}
ACCEPTS = {actor.name: set(actor.accepts) for actor in ACTORS}
MESSAGE_TYPES = [obj for _, obj in inspect.getmembers(messages, inspect.isclass)
                 if dataclasses.is_dataclass(obj) and obj.__module__ == messages.__name__]


def instance_of(cls: type):
    """An instance of a message dataclass without running its ``__init__``."""
    return object.__new__(cls)


def test_the_engine_wires_every_actor_and_each_takes_some_messages():
    assert {a.name for a in ACTORS} == set(PEER_ATTRIBUTES.values())
    for actor in ACTORS:
        assert actor.accepts, actor.name
        assert all(t in MESSAGE_TYPES for t in actor.accepts), actor.name


@pytest.mark.parametrize("actor", ACTORS, ids=lambda a: a.name)
def test_an_inbox_refuses_every_type_its_actor_does_not_take(actor):
    box = actor.mailbox()
    for message_type in MESSAGE_TYPES:
        if message_type in actor.accepts or message_type is messages.Stop:
            box.send(instance_of(message_type))
            assert box.get_nowait().__class__ is message_type
        else:
            with pytest.raises(TypeError, match=f"the {actor.name} actor does not take "
                                                f"{message_type.__name__}"):
                box.send(instance_of(message_type))
    assert box.empty()


def test_a_mailbox_refuses_what_is_not_a_message():
    with pytest.raises(TypeError, match="does not take dict"):
        Mailbox("x", (messages.Stop,)).send({"request_id": "a"})


def _sends(path: Path):
    """(line, peer attribute, message class name) of each
    ``self.<peer>.send(Name(...))`` in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "send" and node.args):
            continue
        target, arg = node.func.value, node.args[0]
        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self" and target.attr in PEER_ATTRIBUTES
                and isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name)):
            yield node.lineno, target.attr, arg.func.id


def test_every_send_in_the_source_goes_to_an_inbox_that_takes_it():
    files = sorted((SRC / "actors").glob("*.py")) + [SRC / "engine.py"]
    checked = 0
    for path in files:
        for line, peer, name in _sends(path):
            actor = PEER_ATTRIBUTES[peer]
            taken = {t.__name__ for t in ACCEPTS[actor]}
            assert name in taken, f"{path.name}:{line} sends {name} to the {actor} actor"
            checked += 1
    assert checked >= 30  # the walk found the sends (there are ~40)


def test_actors_get_their_peers_in_the_constructor():
    for path in sorted((SRC / "actors").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare):
                left = node.test.left
                assert not (isinstance(left, ast.Attribute) and left.attr in PEER_ATTRIBUTES
                            and isinstance(node.test.ops[0], ast.IsNot)), \
                    f"{path.name}:{node.lineno} asserts a peer was wired later"
    engine = ast.parse((SRC / "engine.py").read_text())
    for node in ast.walk(engine):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                # engine.<actor>.<attr> = ... would wire (or reach into) an actor
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
                        and target.value.attr in PEER_ATTRIBUTES):
                    pytest.fail(f"engine.py:{node.lineno} assigns "
                                f"{target.value.attr}.{target.attr}")
