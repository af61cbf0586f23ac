// cluster_occupancy.cu: how many thread-block clusters of each size the GPU holds at once
// (cudaOccupancyMaxActiveClusters), for a 288-thread CTA at a few dynamic shared-memory sizes.
// A standalone program (not part of the engine), built and run on the GPU machine:
//
//   nvcc -arch=sm_90 -o /tmp/cluster_occupancy dev/cluster_occupancy.cu && /tmp/cluster_occupancy
//
// Why: a cluster's CTAs must all sit in one GPC, so at one CTA an SM the GPCs' sizes, not the
// SM count, bound a grid of clusters. decode_attention_rows.cu's grid (one 159 KB CTA an SM on
// the 7B) is 16 clusters of 8; a grid of more clusters than fit runs in waves
// (docs/PERFORMANCE.md, the multi-token step, long contexts).
#include <cstdio>

#include <cuda_runtime.h>

__global__ void probe(int* p) {
  extern __shared__ int s[];
  if (p) p[0] = s[0];
}

int main() {
  const int threads = 288;  // decode_attention_rows.cu's block (8 consumer warps + producer)
  const int smem_kb[] = {160, 112, 100, 200};
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024);
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int kb : smem_kb) {
    for (int c : {1, 2, 4, 8, 16}) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(1, c * 32, 1);
      cfg.blockDim = dim3(threads, 1, 1);
      cfg.dynamicSmemBytes = kb * 1024;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 1;
      attr[0].val.clusterDim.y = c;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = -1;
      const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, probe, &cfg);
      printf("smem %3d KB cluster %2d: max active clusters %3d (%3d CTAs) %s\n", kb, c, n, n * c,
             e ? cudaGetErrorString(e) : "");
    }
  }
  return 0;
}
