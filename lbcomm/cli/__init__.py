"""lbcomm-bench, the installed benchmark CLI (``lbcomm-bench`` or ``python -m lbcomm.cli``).

The benchmark suite of the repository lives in the top-level ``bench/`` folder; this
package is what ``pip install lbcomm`` installs. One module per idea:

* commands.py: what each command does (start or join the ranks, run, report); `main`
* args.py: the parser and the help, one function per command (race's in racecli.py);
  argtypes.py: the value types of the arguments and lbcomm's own rules for them
  (check_onebit, check_cluster); checks.py: every check of the arguments together, before
  anything runs (race's in racecli.py, which imports nothing of checks.py)
* schema.py: the JSON documents (fields, builders, checkers)
* report.py: printed tables, JSON and plot files; plot.py: the plots (matplotlib)
* units.py: the one parser of sizes, parameter counts, rates and times
* allreduce.py, train.py: the rank side of the two benchmarks; soak.py: the soak test
* model.py: the latency-bandwidth cost model; advise.py: step-time predictions on it
* launch.py: how ranks are started and join (over the `lbcomm.comm` transports)
* netem.py: the emulated cluster; netns.py: namespaces, probing, stale cleanup;
  procs.py: process supervision (the one wait loop)
* progress.py: the progress bar
* racecli.py: the race command's launcher side; race.py, racemethods.py: its ranks' side

No import circle among these modules (tests/test_layout.py), deferred imports included.
"""
