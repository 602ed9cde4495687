"""The field metadata keys the JSON reader (io/recordjson.py) compiles into a record's reader."""

# A whole number's least value (a list of them: each one's; a count statistic's is 0 without
# it), a number that must be
# finite (JSON's 1e999 reads as inf; a statistic's must be without it), what an absent field with
# no default reads as, a field a file must hold though code may leave it out (its default is for
# code), a field whose null reads as if absent (older log lines), and a field that reads as its
# default when it is not of its type (an extra nothing checks: a hand-edited file still reads).
LEAST = "hookcli.least"
FINITE = "hookcli.finite"
ABSENT = "hookcli.absent"
REQUIRED = "hookcli.required"
NULL_IS_ABSENT = "hookcli.null_is_absent"
LENIENT = "hookcli.lenient"
