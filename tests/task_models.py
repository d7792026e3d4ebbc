"""Texts the task tests share: sentences with words the tiny tokenizers split into several pieces, punctuation,
capitals, digits and a word no vocabulary has."""

TASK_TEXTS = [
    "hello world, the cat sat on the mat.",
    "Bert runs fast and the dog is slow!",
    "a model of text is good",
    "unbelievable tokenization of xyzzy words",
    "the cat",
    "is it good? 3 dogs sat in 2 cats.",
]
