"""The support desk: an example fleet built only on agent-fleet's public kits and its manifest."""
