"""Oracle for data/numpy_random: prints numpy's own random streams as whitespace-separated integers.

Usage: numpy_streams.py <command> [args] [";" <command> [args] ...]   (one output line per command;
"sum" prints three)
  interval SEED MAX COUNT       RandomState(SEED).randint(0, MAX + 1, COUNT, int64)  (= random_interval)
  shuffle SEED N [N2]           arange(N) shuffled by RandomState(SEED) (then arange(N2), same state)
  raw64 SEED COUNT              PCG64(SEED).random_raw(COUNT)
  seedseq SEED WORDS            SeedSequence(SEED).generate_state(WORDS, uint32)
  integers SEED LOW HIGH COUNT  default_rng(SEED).integers(LOW, HIGH, COUNT, dtype=int32)
  sum SEED N                    N random float64 (as hex) then numpy.sum and w / numpy.sum(w) (as hex)
  binomial SEED N COUNT P...    COUNT draws RandomState(SEED).binomial(N, P[i % len(P)]) (legacy), then
                                randint(0, 2**31) to show where the stream stands
"""
import sys

import numpy


def run(argv):
    if argv[0] == "binomial":
        seed, n, count = (int(a) for a in argv[1:4])
        ps = [float(a) for a in argv[4:]]
        rs = numpy.random.RandomState(seed)
        out = [rs.binomial(n, ps[i % len(ps)]) for i in range(count)] + [rs.randint(0, 2**31)]
        print(" ".join(str(int(x)) for x in out))
        return
    cmd, args = argv[0], [int(a) for a in argv[1:]]
    if cmd == "interval":
        seed, mx, count = args
        out = numpy.random.RandomState(seed).randint(0, mx + 1, size=count, dtype=numpy.int64)
    elif cmd == "shuffle":
        rs = numpy.random.RandomState(args[0])
        out = []
        for n in args[1:]:
            a = numpy.arange(n, dtype=numpy.int64)
            rs.shuffle(a)
            out.extend(a.tolist())
    elif cmd == "raw64":
        seed, count = args
        out = numpy.random.PCG64(seed).random_raw(count)
    elif cmd == "seedseq":
        seed, words = args
        out = numpy.random.SeedSequence(seed).generate_state(words, numpy.uint32)
    elif cmd == "integers":
        seed, low, high, count = args
        out = numpy.random.default_rng(seed).integers(low, high, size=count, dtype=numpy.int32)
    elif cmd == "sum":
        seed, n = args
        rs = numpy.random.RandomState(seed)
        w = rs.random_sample(n) * (10.0 ** rs.randint(-6, 6, size=n))
        total = numpy.sum(w)
        print(" ".join(float(x).hex() for x in w))
        print(float(total).hex())
        print(" ".join(float(x).hex() for x in (w / total)))
        return
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(" ".join(str(int(x)) for x in out))


def main(argv):
    command = []
    for a in argv + [";"]:
        if a == ";":
            if command:
                run(command)
            command = []
        else:
            command.append(a)


if __name__ == "__main__":
    main(sys.argv[1:])
