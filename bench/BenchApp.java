// criuz bench: a JVM holding a large object graph.
//
// Usage: java BenchApp DIR MIB
// Builds about MIB MiB of live objects (nodes with names, int arrays and links
// to other nodes, indexed by a HashMap), writes DIR/ready with its pid, then
// polls for DIR/request. For each request it walks the whole graph and writes
// DIR/answer: "nonce=N nodes=N map=N sum=HEX". The bench compares the answer
// before the checkpoint with the answer of the restored JVM. A request
// "rewrite P N" instead updates P% of the nodes in place (new data values and
// score, as a service updating records does) and answers "nonce=N rewrote=K":
// what an incremental checkpoint then has to store.

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.util.HashMap;
import java.util.Map;
import java.util.Random;

public class BenchApp {
    static final class Node {
        final long id;
        final String name;
        final int[] data;
        Node[] links;
        double score;

        Node(long id, String name, int[] data, double score) {
            this.id = id;
            this.name = name;
            this.data = data;
            this.score = score;
        }
    }

    // Measured heap bytes per node (node, name, data, links, map entry).
    static final long BYTES_PER_NODE = 360;

    static Node[] nodes;
    static HashMap<String, Node> byName;

    static long mix(long h, long v) {
        h ^= v;
        h *= 0x100000001b3L;
        return h ^ (h >>> 29);
    }

    static String checksum() {
        long h = 0xcbf29ce484222325L;
        for (Node n : nodes) {
            h = mix(h, n.id);
            h = mix(h, n.name.hashCode());
            h = mix(h, n.name.length());
            for (int v : n.data) {
                h = mix(h, v);
            }
            for (Node l : n.links) {
                h = mix(h, l.id);
            }
            h = mix(h, Double.doubleToLongBits(n.score));
        }
        long m = 0;
        for (Map.Entry<String, Node> e : byName.entrySet()) {
            m = mix(m, e.getKey().hashCode() ^ e.getValue().id);
        }
        return String.format("nodes=%d map=%d sum=%016x%016x", nodes.length, byName.size(), h, m);
    }

    static int rewrite(double percent, Random r) {
        int k = 0;
        double stride = 100.0 / Math.max(0.001, Math.min(100.0, percent));
        for (double x = r.nextInt((int) Math.ceil(stride)); x < nodes.length; x += stride) {
            Node node = nodes[(int) x];
            for (int i = 0; i < node.data.length; i++) {
                node.data[i] = r.nextInt(1000);
            }
            node.score = r.nextInt(100000) / 100.0;
            k++;
        }
        return k;
    }

    public static void main(String[] args) throws Exception {
        Path dir = Paths.get(args[0]);
        long mib = Long.parseLong(args[1]);
        int n = (int) Math.max(1000, (mib << 20) / BYTES_PER_NODE);
        Random r = new Random(42);
        String[] words = {"checkpoint", "restore", "process", "memory", "kernel", "image", "socket", "container",
            "thread", "signal", "buffer", "server", "request", "latency", "snapshot", "migration"};
        nodes = new Node[n];
        byName = new HashMap<>(n + n / 3 + 1);
        for (int i = 0; i < n; i++) {
            String name = words[r.nextInt(words.length)] + "-" + i + "-" + Integer.toHexString(r.nextInt(1 << 20));
            int[] data = new int[8 + r.nextInt(17)];
            for (int k = 0; k < data.length; k++) {
                data[k] = r.nextInt(1000);
            }
            Node node = new Node(i, name, data, r.nextInt(100000) / 100.0);
            nodes[i] = node;
            byName.put(name, node);
        }
        for (int i = 0; i < n; i++) {
            Node[] links = new Node[4];
            for (int k = 0; k < links.length; k++) {
                links[k] = nodes[r.nextInt(n)];
            }
            nodes[i].links = links;
        }
        System.gc();
        Path ready = dir.resolve("ready");
        Path tmp = dir.resolve("ready.tmp");
        Files.write(tmp, (ProcessHandle.current().pid() + "\n").getBytes(StandardCharsets.UTF_8));
        Files.move(tmp, ready, StandardCopyOption.ATOMIC_MOVE);

        Path request = dir.resolve("request");
        Path answer = dir.resolve("answer");
        Path answerTmp = dir.resolve("answer.tmp");
        while (true) {
            if (Files.exists(request)) {
                String req = new String(Files.readAllBytes(request), StandardCharsets.UTF_8).trim();
                Files.delete(request);
                String line;
                if (req.startsWith("rewrite ")) {
                    String[] w = req.split(" ");
                    int k = rewrite(Double.parseDouble(w[1]), r);
                    line = "nonce=" + w[2] + " rewrote=" + k + "\n";
                } else {
                    line = "nonce=" + req + " " + checksum() + "\n";
                }
                Files.write(answerTmp, line.getBytes(StandardCharsets.UTF_8));
                Files.move(answerTmp, answer, StandardCopyOption.ATOMIC_MOVE);
            }
            Thread.sleep(20);
        }
    }
}
