"""The environment the CLI restarts itself with: OpenBLAS preloaded, one BLAS thread unless told otherwise."""

from orchard.node.openblas import blas_environment

LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def test_a_bare_environment_gets_the_preload_and_one_blas_thread():
    env = blas_environment({"PATH": "/bin", "LD_PRELOAD": "/x/libfoo.so"}, LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{LIB}:/x/libfoo.so", "OPENBLAS_NUM_THREADS": "1"}


def test_a_preload_given_by_hand_still_gets_one_thread_and_a_chosen_count_is_kept():
    assert blas_environment({"LD_PRELOAD": LIB}, None) == {"LD_PRELOAD": LIB, "OPENBLAS_NUM_THREADS": "1"}
    assert blas_environment({"LD_PRELOAD": LIB, "OPENBLAS_NUM_THREADS": "8"}, None) is None


def test_nothing_changes_without_openblas_or_when_it_is_refused():
    assert blas_environment({"PATH": "/bin"}, None) is None
    assert blas_environment({"ORCHARD_NO_OPENBLAS": "1"}, LIB) is None
