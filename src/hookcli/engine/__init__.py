"""The torch side of a pass: model + selection + input → hooked passes, statistics, backward."""
