"""What the tests share: builders of models, tokenizers, logs and folders, independent oracles,
and ways of running hookcli. Test modules import from here, never from one another
(tests/test_architecture.py holds the rule)."""
