"""Test doubles shared by the actor tests."""


class Inbox:
    """Stands in for an actor: records what is sent to it."""

    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)

    def take(self, kind):
        """The messages of type ``kind``, removed from the inbox."""
        found = [m for m in self.messages if isinstance(m, kind)]
        self.messages = [m for m in self.messages if not isinstance(m, kind)]
        return found
