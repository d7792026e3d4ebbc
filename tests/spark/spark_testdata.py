"""Texts shared by the Spark tests."""


TEXTS = ["hello world", "the cat sat on the mat", "a dog runs fast", "bert is a good model",
         "the model is bad", "it is the text of a cat and a dog", "good", "slow slow slow"]
