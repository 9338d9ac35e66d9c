"""`collectives.api.EXTRA_ARGUMENTS` names exactly the optional arguments each hand-written algorithm takes, in its
order: the table is written out (a reader sees what each algorithm gets), and this test keeps it true."""

from __future__ import annotations

import inspect

from collectives.api import ALGORITHMS, EXTRA_ARGUMENTS

OPTIONAL = ("average_over", "layout", "segment_bytes")


def test_every_algorithm_gets_the_extra_arguments_its_signature_names_in_order():
    for collective, algorithms in ALGORITHMS.items():
        for algo, function in algorithms.items():
            if function is None:
                continue
            parameters = [name for name in inspect.signature(function).parameters if name in OPTIONAL]
            assert list(EXTRA_ARGUMENTS.get(function, ())) == parameters, (collective, algo)


def test_the_table_names_only_algorithms_that_are_offered():
    offered = {function for algorithms in ALGORITHMS.values() for function in algorithms.values()}
    assert set(EXTRA_ARGUMENTS) <= offered
