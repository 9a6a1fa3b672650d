// inferencepool.d.ts: the Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1)
// as TypeScript interfaces, written from the extension's API reference, for validate.cjs's strict
// pass (kubernetes-models has no schema for this CRD). Status fields are left out (never rendered).
import type { IObjectMeta } from "@kubernetes-models/apimachinery/apis/meta/v1/ObjectMeta";
import type { ILabelSelector } from "@kubernetes-models/apimachinery/apis/meta/v1/LabelSelector";
export interface IInferencePool {
  apiVersion: "inference.networking.k8s.io/v1";
  kind: "InferencePool";
  metadata: IObjectMeta;
  spec: {
    selector: ILabelSelector;
    targetPorts: Array<{ number: number }>;           // 1..8, unique
    appProtocol?: "http" | "kubernetes.io/h2c";
    endpointPickerRef: {
      name: string;
      group?: string;
      kind?: string;
      port?: { number: number };
      failureMode?: "FailOpen" | "FailClose";
    };
  };
}
